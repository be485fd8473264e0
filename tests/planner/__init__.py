"""Tests of the planner room."""
