"""The notes app."""

from __future__ import annotations

from django.apps import AppConfig


class NotesConfig(AppConfig):
    """What the project's tasks write, in each tenant's schema."""

    name = "tests.deploy.tenants_project.notes"
    label = "notes"
    default_auto_field = "django.db.models.BigAutoField"
