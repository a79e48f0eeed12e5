"""The child flow of a release on work pools (`executor: {kind: pools}`): one variant measured on a worker's host,
its results shared on the release's store. Deployed once per pool as `measure-variant/<pool>` by
`quantgate pools setup`; the flow itself is `quantgate.pools.child.measure_variant`."""

from __future__ import annotations

from quantgate.pools.child import measure_variant

__all__ = ["measure_variant"]
