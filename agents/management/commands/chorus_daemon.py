"""``python manage.py chorus_daemon``: the daemon of SPEC §5, started from the project.

A thin wrapper: it parses the flags (``agents.daemon_config.add_arguments``), merges them with the
environment and the config file (flag > env > file > default) and hands over to
``agents.daemon.main``, which uses nothing of Django. ``python -m agents.daemon`` does the same on
machines that only carry the ``agents`` package.
"""

from django.core.management.base import BaseCommand, CommandError

from agents.daemon import check_backend, main
from agents.daemon_config import ConfigError, add_arguments, config_from_sources, options_from_namespace


class Command(BaseCommand):
    help = ("Run the Chorus daemon: connect to the portal, run agent turns in the allowed directories, "
            "report what happens. Settings: flags > CHORUS_* environment > --config file > defaults.")
    requires_system_checks = []
    requires_migrations_checks = False

    def add_arguments(self, parser):
        add_arguments(parser)

    def handle(self, *args, **options):
        try:
            config = config_from_sources(options_from_namespace(options), config_path=options.get("config"))
            check_backend(config.backend)
        except ConfigError as exc:
            raise CommandError(str(exc)) from None
        status = main(config)
        if status:
            raise CommandError(f"the daemon stopped with status {status}", returncode=status)
