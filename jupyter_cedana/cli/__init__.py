"""`jupyter cedana`: talks to running servers over REST and reads stores."""
