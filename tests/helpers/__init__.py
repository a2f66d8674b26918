"""What the tests share: tiny models built in-process, drafter doubles, the golden sets and their check, decoding
runs (batches, prefix reuse, conversations), exact sampling checks, a local fake Hub, machine facts. Test modules
import from here, never from each other."""
