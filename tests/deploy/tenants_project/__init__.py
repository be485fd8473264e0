"""A django-tenants project with tenant-schemas-celery, run by
``tests/deploy/test_django_tenants.py`` through subprocesses (its own settings module and
database)."""
