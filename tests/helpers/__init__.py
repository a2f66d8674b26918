"""What the tests share: tiny models built in-process, drafter doubles, a local fake Hub, machine facts."""
