"""`python -m celery_agents.cli`: the `agents` command."""

from celery_agents.cli.entry import main

main()
