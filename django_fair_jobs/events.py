"""What one part of the package tells the others without importing them: a Django signal
per event, sent from a lower layer, received by ``signals`` (layer 6)."""

from __future__ import annotations

from django.dispatch import Signal

limit_changed = Signal()
"""A tenant slot's or a queue's limit changed (set, boosted, a boost ended, a queue paused
or resumed), or a tenant's backlog was cancelled (its line may lead with a job of another
task, with another cap): sent with ``tenant`` (None for a queue's limit), ``queue`` (None:
every queue) and ``app`` after the change. Fair dispatch takes the lines the change frees
back into its selection and dispatches the queue at once."""
