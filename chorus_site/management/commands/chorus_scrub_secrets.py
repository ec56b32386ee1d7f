"""Scrub task tokens and one-time keys stored before they were kept off storage (chorus_site/scrub.py).

``migrate`` runs the same scrub; this command is for running it on its own.
"""

from django.core.management.base import BaseCommand

from chorus_site.scrub import stored_secrets_scrub


class Command(BaseCommand):
    help = "Remove task tokens from stored control commands and one-time keys from idempotency records."

    def handle(self, *args, **options):
        counts = stored_secrets_scrub()
        self.stdout.write(f"scrubbed {counts['commands']} command(s), {counts['idempotency_records']} "
                          "idempotency record(s)")
