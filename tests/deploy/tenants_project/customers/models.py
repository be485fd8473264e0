"""The tenant model and its domain model, as django-tenants' guide sets them up."""

from __future__ import annotations

from django.db import models
from django_tenants.models import DomainMixin, TenantMixin  # type: ignore[import-untyped]


class Client(TenantMixin):  # type: ignore[misc]
    """A tenant: its schema is created when it is saved."""

    name = models.CharField(max_length=100)
    auto_create_schema = True


class Domain(DomainMixin):  # type: ignore[misc]
    """A tenant's domain (django-tenants requires the model)."""
