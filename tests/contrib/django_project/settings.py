"""A Django project for outboxer's Django app: one database, given as a URL in the environment.

OUTBOXER_TEST_DJANGO_DB      postgresql://…, mysql://… or sqlite:///… (the database to use)
OUTBOXER_TEST_DJANGO_TEST_DB the name Django's test runner gives its test database
OUTBOXER_TEST_BROKER         the relay's broker URL (settings.OUTBOXER["broker"])
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit

import pymysql

pymysql.install_as_MySQLdb()  # Django's MySQL backend on PyMySQL (no mysqlclient build)

SECRET_KEY = "outboxer-tests"
DEBUG = False
USE_TZ = True
ROOT_URLCONF = "tests.contrib.django_project.urls"
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "outboxer.contrib.django",
    "tests.contrib.django_project.shop",
]
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
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"


def _database(url: str) -> dict[str, object]:
    parts = urlsplit(url)
    test = {"NAME": os.environ.get("OUTBOXER_TEST_DJANGO_TEST_DB")}
    if parts.scheme == "sqlite":  # a file for the test database too: the relay needs one
        name = url.removeprefix("sqlite:///")
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": name, "TEST": test}
    engine = {"postgresql": "postgresql", "mysql": "mysql"}[parts.scheme]
    return {
        "ENGINE": f"django.db.backends.{engine}",
        "NAME": unquote(parts.path.lstrip("/")),
        "USER": parts.username or "",
        "PASSWORD": parts.password or "",
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
        "TEST": test,
    }


DATABASES = {"default": _database(os.environ["OUTBOXER_TEST_DJANGO_DB"])}
OUTBOXER = {"broker": os.environ.get("OUTBOXER_TEST_BROKER", "memory://django-tests")}
