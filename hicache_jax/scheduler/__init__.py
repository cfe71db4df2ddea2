"""Scheduling: which requests run next, and the one adapter that joins requests to the cache."""
