"""Cache tiers: pools of device pages and state slots, the radix prefix tree, the
usable-prefix rule. Nothing here knows what a request is."""
