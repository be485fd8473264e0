"""Tests of the windows room."""
