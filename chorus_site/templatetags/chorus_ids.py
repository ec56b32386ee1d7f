"""``{{ obj.pk|short_id }}``: the distinguishing tail of a time-ordered id (chorus_site.ids)."""

from django import template

from chorus_site import admin_base, ids

register = template.Library()


@register.filter
def short_id(value):
    return ids.short_id(value)


@register.filter
def id_cell(value):
    """The tail with the whole id on hover."""
    return admin_base.id_cell(value)
