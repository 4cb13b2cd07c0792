"""``kvrelay explain REQUEST_ID``: why the router sent a request where it did.

Reads the request's decisions and outcome from the fact store (``--db URL``,
default the SQLite file under the data directory) and prints
``kvrelay.facts.explain.explain_lines``. Exit code 1 when the request is
unknown or the store cannot be read.
"""

from __future__ import annotations

import argparse
import sys

from kvrelay.paths import DATA_ENV


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "request_id", metavar="REQUEST_ID", help="the request to explain (kv-..., or a response id cmpl-kv-...)"
    )
    parser.add_argument(
        "--db",
        metavar="URL",
        default=None,
        help=f"fact store URL (default: sqlite:///<data dir>/facts.sqlite3; data dir from {DATA_ENV} "
        "or ~/.local/share/kvrelay), e.g. postgresql+psycopg://user@host:5432/kvrelay",
    )


RESPONSE_ID_PREFIXES = ("chatcmpl-", "cmpl-")


def router_request_id(given: str) -> str:
    """The router's request id in ``given``: an HTTP response id (``cmpl-kv-...``) loses its prefix."""
    for prefix in RESPONSE_ID_PREFIXES:
        if given.startswith(prefix):
            return given[len(prefix) :]
    return given


def run(args: argparse.Namespace) -> int:
    import sqlalchemy as sa

    from kvrelay.facts.engine import default_url, make_engine, sqlite_path
    from kvrelay.facts.explain import explain_lines
    from kvrelay.facts.queries import FactReader

    request_id = router_request_id(args.request_id)
    url = args.db or default_url()
    try:
        engine = make_engine(url)
    except (ValueError, sa.exc.ArgumentError) as exc:
        print(f"kvrelay explain: {exc}", file=sys.stderr)
        return 1
    shown = engine.url.render_as_string(hide_password=True)
    path = sqlite_path(engine)
    if path is not None and not path.is_file():
        print(f"kvrelay explain: no fact store at {path}; pass --db URL or set {DATA_ENV}", file=sys.stderr)
        return 1
    try:
        history = FactReader(engine).request_history(request_id)
    except sa.exc.SQLAlchemyError as exc:
        print(f"kvrelay explain: cannot read the fact store at {shown}: {exc}", file=sys.stderr)
        return 1
    finally:
        engine.dispose()
    if history is None:
        print(
            f"kvrelay explain: request {request_id!r} has no recorded decisions or outcome in {shown}",
            file=sys.stderr,
        )
        return 1
    print("\n".join(explain_lines(history)))
    return 0
