"""The `disagg` command and `make demo`.

app.py: the typer app (the console script `disagg`) and the `launch` / `check` verbs; common.py:
exit codes, options, config loading and logging shared by every verb; generate.py: `disagg
generate`; demo.py: `make demo` (`python -m disagg.cluster.cli.demo`). The `bench`, `serve` and
simulator verbs live with their packages and are registered in app.py.
"""
