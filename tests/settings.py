"""Settings for the test suite: PostgreSQL by default, SQLite with DATABASE_URL=sqlite:///...

Worker processes started by the tests import these same settings, with DATABASE_URL
pointing at the test database, so every process shares the same rows.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import environ

from django_fair_jobs.conf import RECOMMENDED_SQLITE_OPTIONS

env = environ.Env()
BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = "tests-only-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "tests.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DATABASES = {
    "default": env.db("DATABASE_URL", default="postgres://postgres@127.0.0.1:5432/fair_jobs")
}
# Worker connection reuse, as tests of it start workers with (the suite's default: none).
DATABASES["default"]["CONN_MAX_AGE"] = env.int("CONN_MAX_AGE", default=0)
DATABASES["default"]["CONN_HEALTH_CHECKS"] = env.bool("CONN_HEALTH_CHECKS", default=False)
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # A file, not memory, so that worker processes see the test database.
    DATABASES["default"]["TEST"] = {"NAME": DATABASES["default"]["NAME"]}
    DATABASES["default"]["OPTIONS"] = dict(RECOMMENDED_SQLITE_OPTIONS)

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    # The admin's CSS and JavaScript for the browser test's live server.
    "django.contrib.staticfiles",
    "django_fair_jobs",
    "tests.testapp",
]
# Celery beat's DatabaseScheduler, as projects schedule django_fair_jobs.plan with it
# (tests/deploy/test_beat.py). Installed by the dev extra only: django-celery-beat 2.9
# requires Django < 6.1, so the matrix's Django 6.1 cell has none.
if importlib.util.find_spec("django_celery_beat") is not None:
    INSTALLED_APPS.append("django_celery_beat")
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

CELERY_BROKER_URL = env.str("CELERY_BROKER_URL", default="redis://127.0.0.1:6379/15")
CELERY_RESULT_BACKEND = env.str("CELERY_RESULT_BACKEND", default="redis://127.0.0.1:6379/14")
CELERY_BROKER_TRANSPORT_OPTIONS = env.json("CELERY_BROKER_TRANSPORT_OPTIONS", default={})
CELERY_TASK_ACKS_LATE = True
# The chaos suite turns it on: a job whose pool process is killed goes back to the broker.
CELERY_TASK_REJECT_ON_WORKER_LOST = env.bool("CELERY_TASK_REJECT_ON_WORKER_LOST", default=False)
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_DB_REUSE_MAX = env.int("CELERY_DB_REUSE_MAX", default=0) or None
CELERY_TASK_DEFAULT_QUEUE = "default"
# tests/deploy/test_quorum.py: a RabbitMQ quorum queue bound to a topic exchange under a
# routing key that is not its name, as Celery's docs declare them for native delayed delivery.
_QUORUM_QUEUE = env.str("FAIR_JOBS_TESTS_QUORUM_QUEUE", default="")
if _QUORUM_QUEUE:
    from kombu import Exchange, Queue

    CELERY_TASK_QUEUES = [
        Queue(
            _QUORUM_QUEUE,
            Exchange(_QUORUM_QUEUE, type="topic"),
            routing_key=f"{_QUORUM_QUEUE}.jobs",
            queue_arguments={"x-queue-type": "quorum"},
        )
    ]

# The suite's test tasks without options are tenant slots of 1 (they predate fair dispatch
# as the default). FAIR_JOBS_TESTS_LIBRARY_DEFAULTS=1 leaves the setting unset, as in a new
# project: tests/test_defaults.py runs its workers so.
if not env.bool("FAIR_JOBS_TESTS_LIBRARY_DEFAULTS", default=False):
    FAIR_JOBS_DEFAULT_MAX_JOBS = env.int("FAIR_JOBS_DEFAULT_MAX_JOBS", default=1)
FAIR_JOBS_HEARTBEAT_INTERVAL = env.float("FAIR_JOBS_HEARTBEAT_INTERVAL", default=0.5)
FAIR_JOBS_WORKER_TIMEOUT = env.float("FAIR_JOBS_WORKER_TIMEOUT", default=3.0)
FAIR_JOBS_DISPATCH_SLACK = env.int("FAIR_JOBS_DISPATCH_SLACK", default=1)

# The worker's root handler prints these; no handler of our own, or lines would double.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "loggers": {"django_fair_jobs": {"level": "INFO"}},
}

STATIC_URL = "static/"
