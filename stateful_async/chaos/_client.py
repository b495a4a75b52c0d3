"""``ServiceEnrichment``: an AsyncFunction that enriches rows from the mock service."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from .._exceptions import ConfigurationError, StatefulAsyncError
from .._function import AsyncFunction


class ServiceError(StatefulAsyncError):
    """The service answered with an error status, >= 400 (retry it with a RetryStrategy:
    ``retry_on_exception=(ServiceError,)``)."""

    def __init__(self, status: int, key: str) -> None:
        super().__init__(f"HTTP {status} for key {key!r}")
        self.status = status
        self.key = key


class ServiceEnrichment(AsyncFunction[dict[str, Any], dict[str, Any]]):
    """Looks up ``row[key_field]`` at ``{url}/enrich`` and returns the row with ``fields``
    of the answer added. One ``aiohttp.ClientSession`` per operator (made in ``open``, so
    the function pickles for Spark). An HTTP error status (>= 400) raises ``ServiceError``;
    ``fallback``, if given, is returned (merged into the row) when an element times out.
    A ``url`` that is not ``http://`` or ``https://`` with a host (and a valid port) raises
    ``ConfigurationError`` here, not on every row in the tasks.
    """

    def __init__(
        self,
        url: str,
        key_field: str = "id",
        fields: tuple[str, ...] = ("score", "label"),
        fallback: dict[str, Any] | None = None,
        max_connections: int = 1000,
    ) -> None:
        self.url = _checked_url(url).rstrip("/")
        self.key_field = key_field
        self.fields = tuple(fields)
        self.fallback = fallback
        self.max_connections = max_connections
        self._session: Any = None

    async def open(self) -> None:
        import aiohttp

        if self._session is not None:  # opened again: not a session left unclosed (not by
            await self._session.close()  # self.close(), which a subclass may count)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.max_connections, force_close=False),
            timeout=aiohttp.ClientTimeout(total=None),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def async_invoke(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        key = str(row[self.key_field])
        async with self._session.get(f"{self.url}/enrich", params={"key": key}) as response:
            if response.status >= 400:
                raise ServiceError(response.status, key)
            answer = await response.json()
        return [{**row, **{name: answer[name] for name in self.fields}}]

    async def timeout(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        if self.fallback is None:
            return list(await super().timeout(row))
        return [{**row, **self.fallback}]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_session"] = None
        return state


def _checked_url(url: Any) -> str:
    try:
        parts = urlsplit(url)
        # .port raises ValueError for a port past 65535
        usable = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except (TypeError, ValueError, AttributeError):
        usable = False
    if not usable:
        raise ConfigurationError(
            f"The service URL must be http:// or https://, a host and, if given, a port "
            f"(1-65535), such as http://127.0.0.1:8099; got {url!r}."
        )
    return str(url)
