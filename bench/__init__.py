"""The benchmark (`run.py`: celery-agents against plain Celery, a naive Celery loop and DBOS, in one
run), the phases it runs, what they share (`harness.py`, `processes.py`), and `probes/`: one-off
measurements, each a script of its own."""
