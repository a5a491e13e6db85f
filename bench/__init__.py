"""The benchmark against plain Celery (`run.py`) and the scale check (`scale.py`)."""
