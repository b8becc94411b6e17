"""full: every weight trains, computing in the compute dtype, with fp32 masters and optimizer state; the router in
fp32. A sync sends the weights in the compute dtype and the routers in fp32, bit for bit (``Mode``'s defaults)."""

from moerl.modes.base import Mode


class Full(Mode):
    name = "full"
