"""Isolation: how the lab runs a path it does not trust in a room of its own, and judges it from outside.

    worker.py   a user path's own process (forked from a zygote that imported torch and that module only)
    user.py     a path from outside (op.user_impls): its spec resolved and read, never run, in the lab
    outside.py  a path in a worker timed by the lab's clock over batches of distinct input sets
    rooms.py    every path's own buffers, rotating input sets, torch's state read around timed regions
    guards.py   inputs unchanged, no aliasing, the Triton launches a path names

The stages reach it through lab/runner.py, never directly by a path's origin.
"""
