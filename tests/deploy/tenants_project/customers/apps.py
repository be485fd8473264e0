"""The customers app."""

from __future__ import annotations

from django.apps import AppConfig


class CustomersConfig(AppConfig):
    """Tenants and their domains, in the public schema."""

    name = "tests.deploy.tenants_project.customers"
    label = "customers"
    default_auto_field = "django.db.models.BigAutoField"
