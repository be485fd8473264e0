"""The shared app holding the tenant model and its domains (``SHARED_APPS``)."""
