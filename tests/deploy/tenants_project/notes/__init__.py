"""A tenant app (``TENANT_APPS``): its table exists in each tenant's schema only."""
