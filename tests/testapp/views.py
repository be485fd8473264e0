"""An async view that publishes fair jobs, as a project's async views would."""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse

from tests.testapp import tasks


async def publish(request: HttpRequest, tenant: str) -> JsonResponse:
    """Publish a rerouted job and a planned job of ``tenant`` from the event loop."""
    rerouted = tasks.rerouted.delay(tenant)
    planned = tasks.planned.apply_async((tenant,))
    return JsonResponse({"rerouted": rerouted.id, "planned": planned.id})
