"""Newest-first pages of a listing (a sorted set: id -> created_at), continued after the id that ended the previous
page (`after`, as OpenAI's lists take it), even when that id has left the listing since.

A page resumes at a position (created_at, then id: ZREVRANGE's order of equal scores), not at the id's rank:
a file deleted, or a batch expired, between two pages has no rank, and the listing restarted from the top
(a client deleting files as it paged listed its first pages again). An id taken out of a listing leaves its
score under keys.unlisted for keys.UNLISTED_TTL_S; an `after` known neither way is a 400 naming it."""

from collections.abc import Awaitable, Callable

from redis.asyncio import Redis

from gateway.errors import ApiError
from shared import keys
from shared.job_state import ErrorCode


def unknown_cursor(after: str, kind: str) -> ApiError:
    return ApiError(
        400,
        ErrorCode.INVALID_REQUEST,
        f"no {kind} `{after}` in this list (never in it, or removed over a day ago): list from the start",
        field="after",
    )


async def ids_after(redis: Redis, index: str, after: str | None, count: int) -> list[tuple[str, float]]:
    """Up to `count` (id, score) of `index`, newest first, after `after` (None: from the newest). LookupError:
    `after` is neither in the listing nor left by one taken out of it."""
    if after is None:
        newest: list[tuple[str, float]] = await redis.zrevrange(index, 0, count - 1, withscores=True)  # type: ignore[assignment]
        return newest
    score: float | None = await redis.zscore(index, after)
    if score is None:
        left: str | None = await redis.get(keys.unlisted(after))  # type: ignore[assignment]
        if left is None:
            raise LookupError(after)
        score = float(left)
    num_equal = int(await redis.zcount(index, score, score))  # at `after`'s own score: those after it come first
    rows: list[tuple[str, float]] = await redis.zrange(  # type: ignore[assignment]
        index, score, "-inf", desc=True, byscore=True, offset=0, num=count + num_equal, withscores=True
    )
    return [(member, s) for member, s in rows if s < score or member < after][:count]


async def remember(redis: Redis, object_id: str, score: float | None) -> None:
    """`object_id` left its listings (deleted, expired): keep its score for the pages that ended on it."""
    if score is not None:
        await redis.set(keys.unlisted(object_id), repr(score), ex=keys.UNLISTED_TTL_S)


async def unlist(redis: Redis, index: str, gone: list[tuple[str, float]]) -> None:
    """Take the (id, score) of objects whose records are gone (expired) out of `index`, each remembered."""
    for object_id, score in gone:
        await remember(redis, object_id, score)
    if gone:
        await redis.zrem(index, *(object_id for object_id, _ in gone))


Records = Callable[[list[str]], Awaitable[list[dict[str, str] | None]]]  # ids -> their records (None: gone)


async def live_page(
    redis: Redis,
    index: str,
    after: str | None,
    limit: int,
    records_of: Records,
    keep: Callable[[dict[str, str]], bool] = lambda fields: True,  # a filter: the others are passed over
) -> tuple[list[dict[str, str]], bool]:
    """Up to `limit` records of `index`'s objects that `keep` takes, newest first, after `after` -> (records,
    has_more). An object whose record is gone (expired) leaves the listing as a page meets it, its place
    remembered for a page that ended on it; the page reads on past it. LookupError: an `after` the listing does
    not know."""
    found: list[dict[str, str]] = []
    while len(found) <= limit:
        wanted = limit + 1 - len(found)
        rows = await ids_after(redis, index, after, wanted)
        if not rows:
            break
        after = rows[-1][0]
        records = await records_of([object_id for object_id, _ in rows])
        found += [fields for fields in records if fields and keep(fields)]
        await unlist(redis, index, [row for row, fields in zip(rows, records, strict=True) if not fields])
        if len(rows) < wanted:
            break
    return found[:limit], len(found) > limit
