from __future__ import annotations

from django.apps import AppConfig


class ShopConfig(AppConfig):
    """A shop whose merchants import product files in the background."""

    name = "shop"
    default_auto_field = "django.db.models.BigAutoField"
