"""Tests of the slots room."""
