"""Example project settings, read with django-environ.

With no environment at all it runs on embedded defaults: SQLite for the project and kombu's
SQLAlchemy transport on a second SQLite file as the broker, both under ``.demo/`` (no
service needed). Point it at real services with, e.g.::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/fair_jobs_example \\
    CELERY_BROKER_URL=redis://127.0.0.1:6379/0 python manage.py run_demo
"""

from __future__ import annotations

from pathlib import Path

import environ

from django_fair_jobs.conf import RECOMMENDED_SQLITE_OPTIONS

BASE_DIR = Path(__file__).resolve().parent.parent
env = environ.Env()
environ.Env.read_env(BASE_DIR / ".env")  # optional; never committed

DEMO_DIR = Path(env.str("DEMO_DIR", default=str(BASE_DIR / ".demo")))
DEMO_DIR.mkdir(parents=True, exist_ok=True)

SECRET_KEY = env.str("SECRET_KEY", default="example-only-not-secret")
DEBUG = env.bool("DEBUG", default=True)
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1"])
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "example.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
STATIC_URL = "static/"

DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{DEMO_DIR / 'db.sqlite3'}")}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"]["OPTIONS"] = dict(RECOMMENDED_SQLITE_OPTIONS)
# Persistent connections, checked before reuse. Celery workers also need
# CELERY_DB_REUSE_MAX (below); see docs/howto.md, "Keep worker connections open".
DATABASES["default"]["CONN_MAX_AGE"] = env.int("CONN_MAX_AGE", default=600)
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_fair_jobs",
    "bench",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
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

# kombu's SQLAlchemy transport takes each message in its own SQLite transaction, so it is
# safe with a worker and a publisher at once (its filesystem transport can hand a reader a
# half-written message file: kombu issue #1551).
CELERY_BROKER_URL = env.str("CELERY_BROKER_URL", default="")
if not CELERY_BROKER_URL:
    # A plain SQLAlchemy URL with our transport class (a "sqla+" URL would pick kombu's own).
    CELERY_BROKER_URL = f"sqlite:///{DEMO_DIR / 'broker.sqlite3'}"
    CELERY_BROKER_TRANSPORT = "example.broker:Transport"

CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Celery's Django fixup closes every connection before and after every task unless this is
# set; it then closes them every 2 x N tasks instead (django-fair-jobs drops broken and
# old ones before each job, and warns with fair_jobs.W004 when this is missing).
CELERY_DB_REUSE_MAX = env.int("CELERY_DB_REUSE_MAX", default=1000)

# FAIR_JOBS_* settings are read from the environment by the library itself.
