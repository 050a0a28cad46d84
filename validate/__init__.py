"""Checks a user runs on a live fleet before trusting a group."""
