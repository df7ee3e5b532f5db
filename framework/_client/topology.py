"""Where things are, as this client knows it: the data nodes it routes to and the lookup image.

Both are learned from the index and both go stale the same ways (a node joins, leaves or
restarts; the controller restarts): :class:`Topology` asks the index for the nodes (one
control call), hands them to the record I/O layer, and, when it has no image from this
controller yet, asks where the image is and opens it. A failed transfer makes it relearn
before the next I/O, at most once a second, so a node that is simply down does not cost a
round trip per call. An image that cannot be read may have moved (its server restarted at
another address): where it is is asked again, at most once a second, then less often while
it stays out of reach.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvfabric._client.image_reader import ImageReader, ImageSlot
from kvfabric._client.index_calls import IndexCalls
from kvfabric._client.record_io import RecordIO

__all__ = ["Topology"]

# After a transport failure, nodes are relearned at most this often.
_RELEARN_INTERVAL = 1.0
# An unreadable image's location is asked again after this long, doubling up to the maximum
# while it stays out of reach.
_IMAGE_RECHECK_MIN = 1.0
_IMAGE_RECHECK_MAX = 30.0


class Topology:
    """One store's view of its data nodes and of the index's lookup image."""

    def __init__(
        self,
        calls: IndexCalls,
        records: RecordIO,
        image: ImageReader | None,
        locate_image: Callable[[], tuple[ImageReader | None, bool]] | None,
    ) -> None:
        """``image``: a reader of the index's lookup image; ``locate_image``: asks the
        controller where its image is (see ``Store``)."""
        self._calls = calls
        self._records = records
        self._image = ImageSlot(image)
        self._locate_image = locate_image
        self._image_unlocated = locate_image is not None
        self._relocate_due = False
        self._image_rechecked_at = 0.0
        self._image_recheck_interval = _IMAGE_RECHECK_MIN
        self._image_unreachable = False
        """The controller serves an image this client could not open (yet)."""
        self._nodes_stale = True
        self._relearned_at = 0.0
        self._learned_nodes: frozenset[tuple[int, int]] | None = None

    @property
    def learned_nodes(self) -> frozenset[tuple[int, int]] | None:
        """(id, incarnation) of the nodes last learned; None before any was learned."""
        return self._learned_nodes

    @property
    def nodes_stale(self) -> bool:
        """Whether the nodes must be learned again before the next I/O."""
        return self._nodes_stale

    # -- the data nodes ----------------------------------------------------------------

    def refresh(self) -> bool:
        """Learn the nodes from the index (one call), and the image's place if due;
        whether the index answered."""
        self._nodes_stale = False
        nodes = self._calls.ask(self._calls.index.nodes)
        if nodes is None:
            self._nodes_stale = True
            return False
        self._records.set_nodes(nodes)
        self._learned_nodes = frozenset((n.id, n.incarnation) for n in nodes)
        if self._image_unlocated:
            self._relocate_image()
        return True

    def learn(self, nodes: set[int]) -> None:
        """Make sure the record I/O layer knows ``nodes`` before they are read or written."""
        if not nodes or (not self._nodes_stale and self._records.reaches(nodes)):
            return
        # A node joined after we connected, or the controller restarted: relearn.
        self.refresh()

    def learn_unknown(self, nodes: set[int]) -> None:
        """Learn the nodes only if one of ``nodes`` is not known at all (a read falling
        over to another copy right after a node failed must not cost a control call)."""
        if not self._records.reaches(nodes):
            self.refresh()

    def relearn_after_failure(self) -> None:
        """A node failed or refused us: its route may be stale (it restarted elsewhere).
        Relearn before the next I/O, at most once per ``_RELEARN_INTERVAL``."""
        now = time.monotonic()
        if now - self._relearned_at >= _RELEARN_INTERVAL:
            self._relearned_at = now
            self._nodes_stale = True

    def nodes_changed(self) -> None:
        """A node joined, left, restarted or was replaced: relearn before the next I/O."""
        self._nodes_stale = True

    def controller_restarted(self) -> None:
        """Node ids are stale, and the controller's image, if any, is another one: stop
        reading the old one now."""
        self._nodes_stale = True
        if self._locate_image is not None:
            self._image.replace(None)
            self._image_unlocated = True
            self._relocate_due = True

    # -- the lookup image --------------------------------------------------------------

    def image_reader(self) -> ImageReader | None:
        """The image reader to probe now (None: ask the index), after learning where the
        image is if that is due."""
        if self._relocate_due:
            # A restarted controller serves another image (if any), or the image's server
            # moved: learn where, once.
            self._relocate_due = False
            self.refresh()
        reader = self._image.reader
        if reader is None and self._image_unreachable:
            self.recheck_image()
        return reader

    @property
    def image_in_use(self) -> ImageReader | None:
        """The current image reader, as it is (no relocation)."""
        return self._image.reader

    def expect_image_rewrites(self, rewrites: int) -> None:
        """This client's publish rewrote ``rewrites`` of the image's buckets: a mirror reads
        them with the next lookup's one read (:meth:`ImageReader.expect`)."""
        reader = self._image.reader
        if reader is not None and rewrites:
            reader.expect(rewrites)

    def recheck_image(self) -> None:
        """Ask where the image is before the next lookup: one that cannot be read may have
        moved. Until the controller answers, the reader stays."""
        now = time.monotonic()
        if self._locate_image is None or now - self._image_rechecked_at < (
            self._image_recheck_interval
        ):
            return
        self._image_rechecked_at = now
        self._image_unlocated = True
        self._relocate_due = True

    def close(self) -> None:
        """Close the image reader."""
        self._image.replace(None)

    def _relocate_image(self) -> None:
        """Ask the controller where its lookup image is and open it (or learn it has none)."""
        assert self._locate_image is not None
        # The old reader goes first: both may use the same transport client's pseudo-node.
        self._image.replace(None)
        located = self._calls.ask(self._locate_image)
        if located is None:
            return  # no answer: asked again the next time the nodes are learned
        reader, retry = located
        self._image_unlocated = False
        self._image.replace(reader)
        self._image_unreachable = retry
        if self._image_unreachable:
            # Asked again later, less often each time it stays out of reach.
            self._image_recheck_interval = min(2 * self._image_recheck_interval, _IMAGE_RECHECK_MAX)
        else:
            self._image_recheck_interval = _IMAGE_RECHECK_MIN
