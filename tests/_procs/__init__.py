"""Real processes for the tests that start, watch, freeze and SIGKILL them.

- `worker.py`: the one worker program (`python -m tests._procs.worker --tasks MODULE ...`) and
  what the tasks it serves read inside it (`config()`, `say()`, `until_file()`, ...).
- `support.py`: the test process's side: `Spawner` starts workers (or any program) with their
  output in files, waits for their lines, signals them, and kills every one at teardown.
"""
