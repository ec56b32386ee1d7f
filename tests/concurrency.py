"""Running calls truly at the same time, for the PostgreSQL race tests."""

from __future__ import annotations

import threading

from django.db import connection as db_connection

from chorus_site.errors import ApplicationError


def run_together(*calls, timeout=30):
    """Run each callable in its own thread, released at once by a barrier; returns their outcomes.

    An outcome is "ok", the ApplicationError code, or the repr of any other exception.
    """
    barrier = threading.Barrier(len(calls))
    outcomes: list = [None] * len(calls)

    def worker(index, call):
        try:
            barrier.wait(timeout=timeout)
            call()
            outcomes[index] = "ok"
        except ApplicationError as error:
            outcomes[index] = error.code
        except Exception as error:  # noqa: BLE001 - reported to the test
            outcomes[index] = repr(error)
        finally:
            db_connection.close()

    threads = [threading.Thread(target=worker, args=(i, call)) for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
        assert not thread.is_alive(), "a racing thread did not finish"
    return outcomes
