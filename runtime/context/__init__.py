"""The services every contract shares: the app (engine facts, limits, refusals), loads, metrics, hub submission."""
