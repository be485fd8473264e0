"""The demo's broker: kombu's SQLAlchemy transport, polling often.

kombu hands every transport option to SQLAlchemy's ``create_engine``, so the polling
interval cannot be set as an option; it is a class attribute here instead.
"""

from __future__ import annotations

from kombu.transport.sqlalchemy import Transport as SQLAlchemyTransport


class Transport(SQLAlchemyTransport):
    """SQLAlchemy transport that polls every 10 ms instead of every second."""

    polling_interval = 0.01
