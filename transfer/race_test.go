//go:build race

package transfer

// raceDetector: this test binary runs under the race detector.
const raceDetector = true
