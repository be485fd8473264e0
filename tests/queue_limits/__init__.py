"""Tests of the limits room."""
