"""Triton's rate limiter (``--rate-limit execution_count``): model instances run only while they hold the
resources their instance group asks for.

An instance group's ``rate_limiter { resources { name count global } priority }`` says how many copies of
each named resource one of its instances needs to run a batch. Resources are per device (the instance's
device) unless ``global``. A resource has, by default, as many copies as the largest count any loaded
instance asks for; ``--rate-limit-resource <name>:<count>[:<device>]`` sets it instead (for every device when
no device is named; a global resource takes the largest count given for its name), and then every resource an
instance needs must be given there in a large enough count, or the model fails to load.

Instances with a batch to run wait in one queue across all models, ordered by their execution count times
their priority (``priority`` 0 counts as 1: an instance of priority 2 gets half the turns of one of priority 1).
Only the head of the queue is given its resources: when they are not free, the instances behind it wait too,
as Triton's do. The resources go back when the batch has run.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InvalidArgument

if TYPE_CHECKING:
    from ..runtime import ModelRuntime

GLOBAL = "global"  # the device key of global resources


@dataclass(frozen=True, slots=True)
class ResourceLimit:
    """One ``--rate-limit-resource``: ``count`` copies of ``name`` on ``device`` (None: on every device)."""

    name: str
    count: int
    device: int | None = None


def parse_resource(text: str) -> ResourceLimit:
    """``<name>:<count>[:<device>]`` (Triton's ``--rate-limit-resource``)."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[0]:
        raise ValueError(f"'{text}': expected <name>:<count>[:<device>]")
    try:
        count = int(parts[1])
        device = int(parts[2]) if len(parts) == 3 else None
    except ValueError:
        raise ValueError(f"'{text}': count and device must be integers") from None
    if count < 0 or (device is not None and device < 0):
        raise ValueError(f"'{text}': count and device must be >= 0")
    return ResourceLimit(parts[0], count, device)


@dataclass(eq=False, slots=True)
class InstanceLimits:
    """What one model instance needs to run: ``{(device key, resource): count}``, and its priority."""

    owner: str  # model / instance, for messages
    needs: dict[tuple[object, str], int]
    priority: int = 1
    executions: int = 0

    def scaled_priority(self) -> int:
        return self.executions * self.priority


class RateLimiter:
    """The server's resources and the queue of instances waiting for them (event-loop thread only)."""

    def __init__(self, explicit: list[ResourceLimit] | tuple[ResourceLimit, ...] = ()) -> None:
        self.explicit = list(explicit)
        self._instances: dict[int, list[InstanceLimits]] = {}  # id(runtime) -> its instances' needs
        self._capacity: dict[tuple[object, str], int] = {}
        self._in_use: dict[tuple[object, str], int] = {}
        self._queue: list[tuple[int, int, InstanceLimits, asyncio.Future]] = []
        self._order = itertools.count()

    # -- instances of loaded models -------------------------------------------------------------
    def add_model(self, runtime: "ModelRuntime") -> None:
        """Give every instance of ``runtime`` its needs (``slot.limits``); InvalidArgument when the resources
        given with --rate-limit-resource cannot let them run."""
        groups = {group.name: group for group in runtime.config.instance_group}
        instances = []
        for slot in runtime.slots:
            ctx = slot.instance.ctx
            group = groups.get(ctx.group_name)
            limiter = group.rate_limiter if group is not None and group.HasField("rate_limiter") else None
            needs: dict[tuple[object, str], int] = {}
            for resource in limiter.resources if limiter is not None else ():
                if not resource.name:
                    raise InvalidArgument(f"model '{runtime.name}': instance_group '{ctx.group_name}' names a "
                                          "rate limiter resource without a name")
                key = (GLOBAL if getattr(resource, "global") else ctx.device_id, resource.name)
                needs[key] = needs.get(key, 0) + resource.count
            priority = max(limiter.priority, 1) if limiter is not None else 1
            slot.limits = InstanceLimits(f"{runtime.name}/{ctx.name}", needs, priority)
            instances.append(slot.limits)
        previous = self._instances.get(id(runtime))
        self._instances[id(runtime)] = instances
        try:
            self._capacity = self._limits()
        except InvalidArgument:
            if previous is None:
                del self._instances[id(runtime)]
            else:
                self._instances[id(runtime)] = previous
            for slot in runtime.slots:
                slot.limits = None
            raise
        self._grant()

    def remove_model(self, runtime: "ModelRuntime") -> None:
        if self._instances.pop(id(runtime), None) is not None:
            self._capacity = self._limits()
            self._grant()

    def _limits(self) -> dict[tuple[object, str], int]:
        """Copies of every resource some instance needs: the largest need, or what the flags give."""
        largest: dict[tuple[object, str], int] = {}
        for instances in self._instances.values():
            for instance in instances:
                for key, count in instance.needs.items():
                    largest[key] = max(largest.get(key, 0), count)
        global_names = {name for device, name in largest if device == GLOBAL}
        for device, name in largest:
            if device != GLOBAL and name in global_names:
                raise InvalidArgument(f"Resource \"{name}\" is present as both global and device-specific resource "
                                      "in the model configuration.")
        if not self.explicit:
            return largest
        capacity = {}
        for (device, name), needed in largest.items():
            given = [r.count for r in self.explicit if r.name == name
                     and (device == GLOBAL or r.device is None or r.device == device)]
            count = max(given, default=0)
            if count < needed:
                raise InvalidArgument(f"Resource count for \"{name}\" is limited to {count} which will prevent "
                                      f"scheduling of one or more model instances, the minimum required count is "
                                      f"{needed}")
            capacity[(device, name)] = count
        return capacity

    # -- running ------------------------------------------------------------------------------------
    async def acquire(self, instance: InstanceLimits) -> None:
        """Wait for the instance's turn and resources; they are held until :meth:`release`."""
        if not self._queue and self._fits(instance):
            self._take(instance)
            return
        future = asyncio.get_running_loop().create_future()
        entry = (instance.scaled_priority(), next(self._order), instance, future)
        heapq.heappush(self._queue, entry)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(instance)  # granted just as the wait was cancelled
            self._grant()  # a cancelled head no longer blocks the queue
            raise

    def release(self, instance: InstanceLimits) -> None:
        for key, count in instance.needs.items():
            self._in_use[key] -= count
        self._grant()

    def waiting(self) -> int:
        return sum(1 for entry in self._queue if not entry[3].done())

    def _fits(self, instance: InstanceLimits) -> bool:
        capacity, in_use = self._capacity, self._in_use
        return all(in_use.get(key, 0) + count <= capacity.get(key, 0) for key, count in instance.needs.items())

    def _take(self, instance: InstanceLimits) -> None:
        for key, count in instance.needs.items():
            self._in_use[key] = self._in_use.get(key, 0) + count
        instance.executions += 1

    def _grant(self) -> None:
        """Give the head of the queue its resources while they are free."""
        queue = self._queue
        while queue:
            _, _, instance, future = queue[0]
            if future.done():  # cancelled while waiting
                heapq.heappop(queue)
                continue
            if not self._fits(instance):
                return
            heapq.heappop(queue)
            self._take(instance)
            future.set_result(None)
