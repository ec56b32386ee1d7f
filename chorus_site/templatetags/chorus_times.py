"""``{{ value|when }}`` and ``{% duration start end %}``: readable times (chorus_site.times)."""

from django import template

from chorus_site import times

register = template.Library()


@register.filter
def when(value):
    return times.when_html(value)


@register.simple_tag
def duration(start, end):
    return times.duration_html(start, end)


@register.filter
def when_iso(value):
    """The same, for a time already serialised as ISO 8601 (the dashboard's JSON data)."""
    return times.when_html(times.parse_iso(value)) if value else times.EMPTY
