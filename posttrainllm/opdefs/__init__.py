"""User paths: resolving `op.user_impls` (user.py) and the worker process they run in (worker.py)."""
