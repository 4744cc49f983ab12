"""Scheduling: requests, the scheduler, admission of chunks, selective recompute, what a step runs."""
