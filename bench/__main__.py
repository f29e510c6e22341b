from bench.run import main

if __name__ == "__main__":  # spawned load processes import this module too
    raise SystemExit(main())
