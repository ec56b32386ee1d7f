from django.contrib import admin
from django.urls import path
from django.views.generic import RedirectView

from .api import api

admin.site.site_header = "Chorus Ops"
admin.site.site_title = "Chorus Ops"
admin.site.index_title = "Operations console"

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False)),
    path("admin/", admin.site.urls),
    path("api/v1/", api.urls),
]
