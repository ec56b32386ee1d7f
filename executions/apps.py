from django.apps import AppConfig


class ExecutionsConfig(AppConfig):
    name = "executions"
    verbose_name = "Executions"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        # The engine hears about the turns that execute attempts (sessions_app never imports us).
        from sessions_app.listeners import on_turn_status

        from .engine import on_turn_status as engine_on_turn_status

        on_turn_status(engine_on_turn_status)

        # A turn settled offline whose attempt the engine has ended does not run again.
        from sessions_app.listeners import on_turn_reopen

        from .engine import turn_reopen_check

        on_turn_reopen(turn_reopen_check)

        # Attempt turns carry their ids and a task token, so the agent can talk back.
        from sessions_app.listeners import on_turn_env

        from .task_tokens import attempt_env

        on_turn_env(attempt_env)

        # The session troubleshooting record names the runs and issues its turns worked for.
        from sessions_app.troubleshooting import on_session_record

        from .troubleshooting import session_context

        on_session_record(session_context)
