"""Settings of a django-tenants project with tenant-schemas-celery: the library's tables
are shared (``SHARED_APPS``, in the public schema), the notes table is each tenant's, and
a job's tenant is the schema it is published from (``FAIR_JOBS_TENANT_RESOLVER``).

``DATABASE_URL`` names the project's own database (the test creates it)."""

from __future__ import annotations

import environ

env = environ.Env()

SECRET_KEY = "tests-only-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DATABASES = {"default": env.db("DATABASE_URL")}
DATABASES["default"]["ENGINE"] = "django_tenants.postgresql_backend"
DATABASE_ROUTERS = ("django_tenants.routers.TenantSyncRouter",)

SHARED_APPS = [
    "django_tenants",
    "django.contrib.contenttypes",
    # The coordination rows must be one set for every tenant: in the public schema only.
    "django_fair_jobs",
    "tests.deploy.tenants_project.customers",
]
TENANT_APPS = [
    "django.contrib.contenttypes",
    "tests.deploy.tenants_project.notes",
]
INSTALLED_APPS = SHARED_APPS + [app for app in TENANT_APPS if app not in SHARED_APPS]
TENANT_MODEL = "customers.Client"
TENANT_DOMAIN_MODEL = "customers.Domain"

CELERY_BROKER_URL = env.str("CELERY_BROKER_URL")
CELERY_RESULT_BACKEND = env.str("CELERY_RESULT_BACKEND")
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = "tenants"

FAIR_JOBS_TENANT_RESOLVER = "django_fair_jobs.tenants.schema_name"
FAIR_JOBS_HEARTBEAT_INTERVAL = 0.5
FAIR_JOBS_WORKER_TIMEOUT = 3.0

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "loggers": {"django_fair_jobs": {"level": "INFO"}},
}
