"""API tokens from the command line: create (prints the token as the last line), list, revoke."""

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from chorus_site.audit import audit_record
from chorus_site.models import ApiToken
from chorus_site.tokens import token_create, token_revoke


class Command(BaseCommand):
    help = "Manage API tokens: create --user NAME [--name N] [--expires-days D] | list [--user NAME] | revoke PREFIX"

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="verb", required=True)
        create = sub.add_parser("create", help="create a token and print it once")
        create.add_argument("--user", required=True)
        create.add_argument("--name", default="cli")
        create.add_argument("--expires-days", type=int, default=None)
        listing = sub.add_parser("list", help="list tokens (prefixes only)")
        listing.add_argument("--user", default=None)
        revoke = sub.add_parser("revoke", help="revoke a token by its prefix")
        revoke.add_argument("prefix")

    def handle(self, *args, verb, **options):
        if verb == "create":
            user = get_user_model().objects.filter(username=options["user"]).first()
            if user is None:
                raise CommandError(f"no user named {options['user']!r}")
            if options["expires_days"] is not None and options["expires_days"] < 1:
                raise CommandError("--expires-days must be at least 1")
            token, raw = token_create(user=user, name=options["name"], expires_in_days=options["expires_days"])
            audit_record(actor="cli", action="token.create", target=f"apitoken:{token.pk}", outcome="created")
            self.stdout.write(f"Token {token.name!r} for {user.get_username()} (prefix {token.prefix}); "
                              "it is shown once:")
            self.stdout.write(raw)
        elif verb == "list":
            qs = ApiToken.objects.select_related("user").order_by("id")
            if options["user"]:
                qs = qs.filter(user__username=options["user"])
            for t in qs:
                state = "revoked" if t.revoked else "active"
                self.stdout.write(f"{t.prefix}  {t.user.get_username():<16} {t.name:<16} {state:<8} "
                                  f"expires {t.expires_at or 'never'}")
        else:
            if not token_revoke(prefix=options["prefix"]):
                raise CommandError(f"no active token with prefix {options['prefix']!r}")
            audit_record(actor="cli", action="token.revoke", target=f"apitoken:{options['prefix']}", outcome="revoked")
            self.stdout.write(f"Revoked {options['prefix']}.")
