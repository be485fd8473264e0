from __future__ import annotations

from django.contrib import admin
from django.urls import path

from tests.testapp import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("publish/<str:tenant>/", views.publish),
]
