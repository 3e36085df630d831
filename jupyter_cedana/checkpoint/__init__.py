"""The checkpoint core: CRIU, the image store and its formats. Used by the
server and by the checkpoint agent; it knows neither."""
