from django.contrib import admin
from django.urls import path
from django.views.generic import RedirectView

from . import dashboard
from .api import api
from .metrics_view import metrics_view

admin.site.site_header = "Chorus Ops"
admin.site.site_title = "Chorus Ops"
admin.site.index_title = "Operations console"

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False)),
    # The admin index is the operator's dashboard (before admin.site.urls: it answers /admin/ first).
    path("admin/", admin.site.admin_view(dashboard.index_view), name="chorus_dashboard"),
    path("admin/dashboard/summary.json", admin.site.admin_view(dashboard.summary_view),
         name="chorus_dashboard_summary"),
    path("admin/", admin.site.urls),
    path("api/v1/", api.urls),
    # Prometheus: a bearer token or an allowed address (chorus_site/metrics.py, docs/alerts.md).
    path("metrics", metrics_view, name="chorus_metrics"),
]
