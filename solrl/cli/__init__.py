"""The command line, a module a command (solrl/cli/app.py assembles them; `python -m solrl.cli`)."""
