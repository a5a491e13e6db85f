"""Opening the Redis that holds sessions: `AGENTS_REDIS_URL`, or the embedded local default; and
naming the Celery broker that goes with it.

`redis://`, `rediss://` and `unix://` URLs open one server. `redis+sentinel://` (`rediss+sentinel://`
for TLS) names Sentinel instead: `redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT…]/MASTER[/DB]`.
The state client then asks the sentinels which server is the master before each new connection
(redis-py's `Sentinel.master_for`): after a failover, the connections to the old master fail, are
dropped, and the next ones go to the promoted replica, so a worker follows the master without a
restart. Unless `AGENTS_BROKER_URL` says otherwise the queues follow the same sentinels through
kombu's `sentinel://` transport. The credentials in the URL are the Redis servers'; sentinels that
ask for a password of their own get it from `?sentinel_password=` (and `sentinel_username=`).

`redis+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT…]` (`rediss+cluster://` for TLS) names a
Redis Cluster for state: redis-py's cluster client learns the slots from any node it reaches and
follows MOVED and ASK (a slot migrated) and a replica promoted. Celery's queues cannot live on a
Cluster: they need `AGENTS_BROKER_URL` (RabbitMQ, or a Redis or Sentinel URL), and `broker_url`
refuses without one (`BrokerMissing`).
"""

from __future__ import annotations

import contextlib
import re
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import quote

from celery_agents.redis_import import import_redis
from celery_agents.redis_urls import (
    SENTINEL_FORM,
    ClusterUrl,
    SentinelUrl,
    is_cluster_url,
    is_sentinel_url,
    parse_cluster_url,
    parse_sentinel_url,
)

import_redis()  # without OpenTelemetry (celery_agents/redis_import.py)

import redis  # noqa: E402
import redis.client  # noqa: E402
import redis.cluster  # noqa: E402
from redis.backoff import ExponentialBackoff, NoBackoff  # noqa: E402
from redis.exceptions import NoScriptError  # noqa: E402
from redis.retry import Retry  # noqa: E402
from redis.sentinel import Sentinel, SentinelConnectionPool  # noqa: E402

from celery_agents.config import Settings  # noqa: E402
from celery_agents.errors import BrokerMissing, RedisRefused, RedisUnavailable  # noqa: E402
from celery_agents.store.embedded import EmbeddedRedis  # noqa: E402
from celery_agents.store.outage import UNREACHABLE  # noqa: E402
from celery_agents.store.replication import MASTER, REPLACED, UNSETTLED  # noqa: E402

#: Connections one client may open at once. A steps process runs up to 200 steps on threads (more
#: with `--step-threads`), each with a Redis call in flight; redis-py 8 caps a pool at 100 unless
#: told otherwise and fails the 101st call at once ("Too many connections"). Redis's own
#: `maxclients` defaults to 10,000: the pool opens only what its threads use at once.
MAX_CONNECTIONS = 10_000

#: redis-py's errors that mean Redis is out of reach (store/outage.py `UNREACHABLE`)
_UNREACHED = UNREACHABLE


_OURS: dict[type[redis.RedisError], type[redis.RedisError]] = {}


def _as_ours(kind: type[redis.RedisError]) -> type[redis.RedisError]:
    """redis-py's error class `kind`, made also the project's `RedisUnavailable` (out of reach) or
    `RedisRefused` (an error reply): code in the store that handles redis-py's errors by their
    class (a `WatchError`, NOGROUP, NOSCRIPT in redis-py's own `Script`) goes on seeing them as
    before, and everything above the store sees the project's."""
    if kind not in _OURS:
        ours = RedisUnavailable if issubclass(kind, _UNREACHED) else RedisRefused
        _OURS[kind] = type(kind.__name__, (kind, ours), {"__module__": kind.__module__})
    return _OURS[kind]


def translated(exc: redis.RedisError) -> redis.RedisError:
    """`exc` as the same redis-py error that is also the project's `redis_unavailable`."""
    if isinstance(exc, (RedisUnavailable, RedisRefused)):
        return exc
    ours = _as_ours(type(exc))
    new = ours.__new__(ours, *exc.args)
    new.args = exc.args
    new.__dict__.update(exc.__dict__)
    reached = isinstance(exc, _UNREACHED)
    said = _plain(str(exc))
    new.message = f"cannot reach Redis: {said}" if reached else f"Redis refused a command: {said}"  # type: ignore[attr-defined]
    new.details = {}  # type: ignore[attr-defined]
    new.__traceback__ = exc.__traceback__
    return new


#: a redis-py client's repr (a sentinel's, in MasterNotFoundError): its connection's every option
#: and object ids, of which a message keeps the address
_CLIENT_REPR = re.compile(r"<redis\.client\.Redis\(.*?\bhost=([^,]*),port=([^,]*),.*?\)>\)>\)>")


def _plain(text: str) -> str:
    """`text` with each redis-py client's repr in it replaced by the address it was connecting to."""
    return _CLIENT_REPR.sub(lambda m: f"sentinel {m[1]}:{m[2]}", text)


class _Translated:
    """Failures of the Redis that holds sessions are translated once, here: every error a command
    or a pipeline raises is also a `RedisUnavailable` or a `RedisRefused`, so the runtime, the CLI
    and the HTTP API handle the project's errors and never import redis-py."""

    def execute_command(self, *args: Any, **options: Any) -> Any:
        try:
            return super().execute_command(*args, **options)  # type: ignore[misc]
        except redis.RedisError as exc:
            raise translated(exc) from None


class StateRedis(_Translated, redis.Redis):
    """The client of the Redis that holds sessions, its errors translated (`_Translated`)."""

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> redis.client.Pipeline:
        return StatePipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)


class StatePipeline(_Translated, redis.client.Pipeline):
    """A pipeline of `StateRedis`: its errors translated the same way."""

    #: the address (host, port) of the server that ran the last `execute`, None before one
    served_by: tuple[Any, Any] | None = None

    def reset(self) -> None:  # type: ignore[override]  # redis-py's Pipeline.reset, not the RESET command
        conn = self.connection
        if conn is not None:  # `execute` ends here, before the connection goes back to the pool
            self.served_by = (getattr(conn, "host", None), getattr(conn, "port", None))
        super().reset()

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        """The replies; a pipeline that lost its connection keeps its commands, so that sending it
        again (the store's wait through an outage: `through_outage(pipe.execute)`) sends them all,
        not the empty pipeline redis-py leaves whatever happened."""
        stack = list(self.command_stack)
        try:
            return super().execute(raise_on_error)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self.command_stack = stack
            raise translated(exc) from None
        except redis.RedisError as exc:
            raise translated(exc) from None


def _local_keys(args: tuple[Any, ...]) -> list[Any] | None:
    """The keys of the commands with "movable" keys that the store sends, read from the command
    itself; None for any other command. redis-py asks the cluster's default node (COMMAND GETKEYS,
    a round trip) for these, and when that node is the primary just killed, every such command
    fails until the client is made again: a failover would stop every worker."""
    name = str(args[0]).upper()
    if name in ("EVAL", "EVALSHA") and len(args) > 2:
        return list(args[3 : 3 + int(args[2])])
    if name in ("XREAD", "XREADGROUP"):
        upper = [str(a).upper() for a in args]
        if "STREAMS" in upper:
            rest = args[upper.index("STREAMS") + 1 :]
            return list(rest[: len(rest) // 2])
    return None


class _KeysHere:
    """`_get_command_keys` answered without asking the default node where the command says."""

    def _get_command_keys(self, *args: Any) -> Any:
        keys = _local_keys(args)
        if keys is not None:
            return keys
        return super()._get_command_keys(*args)  # type: ignore[misc]


def _cluster_unreached(exc: Exception) -> redis.RedisError:
    """redis-py's SlotNotCoveredError, not a `RedisError` (no node serves a slot, for a moment
    during a failover), as a ConnectionError that is the project's `RedisUnavailable`: waited out
    like any outage."""
    return translated(redis.ConnectionError(f"no node serves the slot: {exc}"))


class StateCluster(_KeysHere, redis.cluster.RedisCluster):
    """The client of a Redis Cluster holding sessions: errors translated as `StateRedis`'s, and
    pipelines that take what the store sends them (`StateClusterPipeline`)."""

    def execute_command(self, *args: Any, **options: Any) -> Any:
        try:
            return super().execute_command(*args, **options)  # type: ignore[no-untyped-call]
        except redis.RedisError as exc:
            raise translated(exc) from None
        except redis.exceptions.SlotNotCoveredError as exc:
            raise _cluster_unreached(exc) from None

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> Any:
        return StateClusterPipeline(
            self,
            nodes_manager=self.nodes_manager,
            commands_parser=self.commands_parser,
            startup_nodes=self.nodes_manager.startup_nodes,
            result_callbacks=self.result_callbacks,
            cluster_response_callbacks=self.cluster_response_callbacks,
            read_from_replicas=self.read_from_replicas,
            load_balancing_strategy=self.load_balancing_strategy,
            reinitialize_steps=self.reinitialize_steps,
            retry=self.retry,
            lock=self._lock,
            transaction=transaction,
            event_dispatcher=self._event_dispatcher,
        )

    def node_of(self, key: str) -> Any:
        """The primary holding `key`'s slot now (as this client last learnt it)."""
        return self.get_node_from_key(key)  # type: ignore[no-untyped-call]


class StateClusterPipeline(_Translated, _KeysHere, redis.cluster.ClusterPipeline):
    """A pipeline of `StateCluster`. redis-py refuses EVALSHA, MGET, TIME and PUBLISH in a cluster
    pipeline because each could span slots; the store sends them for one slot only (a script's
    KEYS are one slot: tests/store/test_cluster_layout.py), so they are queued like any command.
    A script queued with `queue_script` that a node does not have (a promoted replica: Redis does
    not replicate its script cache) is loaded and sent again on its own, once: NOSCRIPT means it
    did nothing."""

    def __init__(self, parent: StateCluster, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._parent = parent
        self._sources: dict[int, str] = {}

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any:
        return self.execute_command("EVALSHA", sha, numkeys, *keys_and_args)

    def mget(self, keys: Any, *args: Any) -> Any:
        names = [keys, *args] if isinstance(keys, str) else [*keys, *args]
        return self.execute_command("MGET", *names)

    def time(self, **kwargs: Any) -> Any:
        return self.execute_command("TIME", **kwargs)

    def publish(self, channel: Any, message: Any, **kwargs: Any) -> Any:
        return self.execute_command("PUBLISH", channel, message, **kwargs)

    def queue_script(self, sha: str, source: str, keys: list[str], args: list[Any]) -> Any:
        """Queue EVALSHA of a script whose `source` is loaded again where a node lacks it."""
        self._sources[len(self)] = source
        return self.execute_command("EVALSHA", sha, len(keys), *keys, *args)

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        try:
            return self._execute(raise_on_error)
        except redis.exceptions.SlotNotCoveredError as exc:
            raise _cluster_unreached(exc) from None

    def _execute(self, raise_on_error: bool) -> list[Any]:
        """The replies; a pipeline that could not reach a node keeps its commands, so that sending
        it again (the store's wait through an outage: `through_outage(pipe.execute)`) sends them
        all, not an empty pipeline (redis-py empties it whatever happened)."""
        stack = list(self._execution_strategy.command_queue)
        queued = [(c.args, dict(c.options)) for c in stack]
        sources, self._sources = self._sources, {}
        try:
            replies = super().execute(raise_on_error=not sources and raise_on_error)
        except _UNREACHED as exc:
            self._execution_strategy.reset()  # type: ignore[no-untyped-call]
            for args, options in queued:
                super().execute_command(*args, **options)
            self._sources = sources
            raise translated(exc) from None
        except redis.RedisError as exc:
            raise translated(exc) from None
        if sources:
            self._send_again(stack, sources, replies)
            if raise_on_error:
                for reply in replies:
                    if isinstance(reply, redis.RedisError):
                        raise translated(reply)
        return replies

    def _send_again(self, stack: list[Any], sources: dict[int, str], replies: list[Any]) -> None:
        """The scripts a node answered NOSCRIPT to: loaded on every primary, then run again."""
        missing = [i for i in sources if isinstance(replies[i], NoScriptError)]
        if not missing:
            return
        client = self._parent
        for i in missing:
            client.script_load(sources[i])
        for i in missing:
            try:
                replies[i] = client.execute_command(*stack[i].args)
            except redis.RedisError as exc:
                replies[i] = exc


def _client_options() -> dict[str, Any]:
    return {
        "max_connections": MAX_CONNECTIONS,
        # The version CLIENT SETINFO reports, given rather than looked up in the installed
        # packages' metadata (importlib.metadata) by every new connection: ~5 ms of a CLI start.
        "driver_info": redis.DriverInfo(lib_version=redis.__version__),
        "decode_responses": True,
        "socket_connect_timeout": 5,
        "socket_timeout": 30,
        "health_check_interval": 25,
        "retry": Retry(ExponentialBackoff(cap=1.0, base=0.05), 3),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
    }


def client_for_url(url: str) -> redis.Redis:
    """A client for a `redis://`, `rediss://`, `unix://` or `redis+sentinel://` URL (passwords and
    ACL users included)."""
    if is_sentinel_url(url):
        return _sentinel_client(parse_sentinel_url(url))
    if is_cluster_url(url):
        return _cluster_client(parse_cluster_url(url))
    return StateRedis.from_url(url, **_client_options())


def _cluster_client(url: ClusterUrl) -> redis.Redis:
    tls = {"ssl": True, **url.ssl_options} if url.tls else {}
    options = _client_options()
    options.pop("retry_on_error")
    options.pop("retry")
    cluster = StateCluster(
        startup_nodes=[redis.cluster.ClusterNode(host, port) for host, port in url.nodes],  # type: ignore[no-untyped-call]
        username=url.username,
        password=url.password,
        # MOVED, ASK, TRYAGAIN and a node down (a replica being promoted) are retried with a
        # backoff, for ~3 s in all: then the store's own outage bound takes over.
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 10),
        **tls,
        **options,
    )
    return cast("redis.Redis", cluster)


def _sentinel_client(url: SentinelUrl) -> redis.Redis:
    tls = {"ssl": True, **url.ssl_options} if url.tls else {}
    # Sentinels answer small questions: a short timeout and no retry (redis-py's default retries a
    # refused connection ten times, ~3 s), so a dead one is passed over at once for the next.
    asking: dict[str, Any] = {"socket_connect_timeout": 2, "socket_timeout": 2, "retry": Retry(NoBackoff(), 0), **tls}
    if url.sentinel_password is not None:
        asking.update(username=url.sentinel_username, password=url.sentinel_password)
    sentinel = Sentinel(list(url.sentinels), sentinel_kwargs=asking)  # type: ignore[no-untyped-call]
    master: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call]
        url.master,
        redis_class=StateRedis,
        db=url.db,
        username=url.username,
        password=url.password,
        **tls,
        **_client_options(),
    )
    return master


#: how long the sentinels' word on a server stands once heard: the writes of many threads that fall
#: short of their replicas at once (a failover, a split brain) ask them once, not each, at each send
VERDICT_SECONDS = 0.2


def sentinel_verdict(client: redis.Redis) -> Callable[[tuple[Any, Any]], str] | None:
    """For a client that follows Sentinel: what the sentinels say of a server (its address) that
    took a write no replica acknowledged: `MASTER` (it is the master, nothing under way),
    `REPLACED` (they name another) or `UNSETTLED` (one holds the master down by the quorum's word,
    or a failover under way). Every reachable sentinel is asked, and the newest configuration (the highest
    `config-epoch`) is believed: right after a failover one may still name the old master. When
    it names another, the sentinel that knows goes first in redis-py's list and the pool is
    pointed at that master, dropping its idle connections to the old one (`get_master_address`).
    Sentinels that cannot say leave the answer `MASTER`. One thread asks at a time; an answer
    serves every write on that server for `VERDICT_SECONDS` after it came. None for any other
    client."""
    pool = getattr(client, "connection_pool", None)
    if not isinstance(pool, SentinelConnectionPool) or not pool.is_master:
        return None
    manager, service = pool.sentinel_manager, pool.service_name
    asking = threading.Lock()
    heard: dict[tuple[str, int], tuple[float, str]] = {}

    def ask(server: tuple[str, int]) -> str:
        newest: tuple[int, int, tuple[str, int]] | None = None
        unsettled = False
        for index, sentinel in enumerate(list(manager.sentinels)):
            try:
                state = sentinel.sentinel_masters().get(service)
            except redis.RedisError:
                continue
            if not state:
                continue
            unsettled |= bool(set(str(state.get("flags", "")).split(",")) & _UNSETTLED_FLAGS)
            if not manager.check_master_state(state, service):
                continue
            epoch = int(state.get("config-epoch", 0))
            if newest is None or epoch > newest[0]:
                newest = (epoch, index, (str(state["ip"]), int(state["port"])))
        if newest is None or newest[2] == server:
            return UNSETTLED if unsettled else MASTER
        sentinels = manager.sentinels
        if newest[1] < len(sentinels):  # asked first from now on, as redis-py does with the one that answers
            sentinels[0], sentinels[newest[1]] = sentinels[newest[1]], sentinels[0]
        with contextlib.suppress(redis.RedisError):
            pool.get_master_address()  # type: ignore[no-untyped-call]
        return REPLACED

    def verdict(address: tuple[Any, Any]) -> str:
        server = (str(address[0]), int(address[1] or 0))
        with asking:  # those waiting meanwhile take the answer it brings
            said = heard.get(server)
            if said is not None and time.monotonic() - said[0] < VERDICT_SECONDS:
                return said[1]
            answer = ask(server)
            now = time.monotonic()
            for stale in [s for s, (at, _) in heard.items() if now - at >= VERDICT_SECONDS]:
                del heard[stale]
            heard[server] = (now, answer)
            return answer

    return verdict


#: a sentinel's flags for a master that is not settled: down by the quorum's word, or being
#: replaced (not `s_down`, one sentinel's own view: a sentinel cut off from a healthy master
#: would make every write short of its replicas wait)
_UNSETTLED_FLAGS = frozenset({"o_down", "failover_in_progress"})


def state_url(settings: Settings) -> str:
    """The Redis that holds sessions: `AGENTS_REDIS_URL`, else the embedded one's unix socket."""
    return settings.redis_url or EmbeddedRedis(settings.home).url


def _broker_source(settings: Settings) -> str:
    """`AGENTS_BROKER_URL`, else the state Redis's URL."""
    return settings.broker_url or state_url(settings)


def broker_url(settings: Settings) -> str:
    """The Celery broker as kombu names it: `AGENTS_BROKER_URL`, else the state Redis (a unix
    socket as `redis+socket://`, Sentinel as kombu's `sentinel://…;sentinel://…/DB`). State on a
    Cluster and no `AGENTS_BROKER_URL`: `BrokerMissing`."""
    url = _broker_source(settings)
    if is_cluster_url(url):
        raise BrokerMissing(
            "celery-agents keeps sessions on a Redis Cluster (AGENTS_REDIS_URL) but Celery's queues cannot live "
            "there: set AGENTS_BROKER_URL to RabbitMQ (amqp://…) or to a separate Redis or Sentinel "
            "(redis://…, redis+sentinel://…)"
        )
    if url.split("://", 1)[0].lower() == "sentinel":
        raise ValueError(
            f"AGENTS_BROKER_URL: kombu's sentinel:// form cannot name the master; write it {SENTINEL_FORM}"
        )
    if is_sentinel_url(url):
        s = parse_sentinel_url(url)
        auth = ""
        if s.username or s.password is not None:
            auth = quote(s.username or "", safe="") + ":" + quote(s.password or "", safe="") + "@"
        return ";".join(f"sentinel://{auth}{_netloc(host, port)}/{s.db}" for host, port in s.sentinels)
    return "redis+socket://" + url[len("unix://") :] if url.startswith("unix://") else url


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def broker_options(settings: Settings) -> dict[str, Any]:
    """Transport options the broker URL implies: on Sentinel the master's name, and how to reach
    the sentinels (their timeouts, TLS, their own password)."""
    url = _broker_source(settings)
    if not is_sentinel_url(url):
        return {}
    s = parse_sentinel_url(url)
    asking: dict[str, Any] = {"socket_connect_timeout": 2, "socket_timeout": 2}
    if s.tls:
        asking.update(ssl=True, **s.ssl_options)
    if s.sentinel_password is not None:
        asking.update(username=s.sentinel_username, password=s.sentinel_password)
    return {"master_name": s.master, "sentinel_kwargs": asking}


def broker_ssl(settings: Settings) -> dict[str, Any] | None:
    """Celery's `broker_use_ssl` for a `rediss+sentinel://` broker (TLS to the master), else None
    (a `rediss://` URL carries its own)."""
    url = _broker_source(settings)
    if not is_sentinel_url(url):
        return None
    s = parse_sentinel_url(url)
    # kombu turns TLS on only for a non-empty dict: redis-py's default, certificates required.
    return {"ssl_cert_reqs": ssl.CERT_REQUIRED, **s.ssl_options} if s.tls else None
