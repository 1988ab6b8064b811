"""Engine protocol: how Narwhal talks to inference engines and how their failures are classified."""
