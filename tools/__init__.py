"""tessera's build, Hub-cache, publish, demo and GPU-bench commands (run as `python -m tools.<name>`)."""
