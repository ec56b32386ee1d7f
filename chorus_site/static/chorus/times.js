// Readable times (chorus_site/times.py renders the same wording): <time class="chorus-when"> reads
// "3 min ago", <time class="chorus-timer"> "running for 2 m 14 s" and ticks every second; on hover
// the absolute time in the reader's time zone, and in UTC.  Rows added live are picked up too.
(function () {
  "use strict";

  function duration(seconds) {
    if (seconds < 1) return Math.max(0, Math.floor(seconds * 1000)) + " ms";
    var whole = Math.floor(seconds);
    var days = Math.floor(whole / 86400), hours = Math.floor((whole % 86400) / 3600);
    var minutes = Math.floor((whole % 3600) / 60), secs = whole % 60;
    if (days) return days + " d " + hours + " h";
    if (hours) return hours + " h " + (minutes < 10 ? "0" : "") + minutes + " m";
    if (minutes) return minutes + " m " + secs + " s";
    return secs + " s";
  }

  function relative(date, now) {
    var seconds = (now - date) / 1000, future = seconds < 0, text;
    seconds = Math.abs(seconds);
    if (seconds < 5) return "just now";
    if (seconds < 60) text = Math.floor(seconds) + " s";
    else if (seconds < 3600) text = Math.floor(seconds / 60) + " min";
    else if (seconds < 86400) text = Math.floor(seconds / 3600) + " h";
    else if (seconds < 30 * 86400) text = Math.floor(seconds / 86400) + " d";
    else return "on " + date.toISOString().slice(0, 10);
    return future ? "in " + text : text + " ago";
  }

  function hover(date) {
    var local = date.toLocaleString(undefined, {dateStyle: "medium", timeStyle: "medium", timeZoneName: "short"});
    var utc = date.toISOString().replace("T", " ").slice(0, 19) + " UTC";
    return local.indexOf("UTC") >= 0 ? utc : local + " · " + utc;
  }

  function update(root) {
    var now = Date.now();
    (root || document).querySelectorAll("time.chorus-when, time.chorus-timer").forEach(function (node) {
      var date = new Date(node.getAttribute("datetime"));
      if (isNaN(date)) return;
      if (!node.dataset.hover) {
        node.dataset.hover = "1";
        node.title = (node.classList.contains("chorus-timer") ? "since " : "") + hover(date);
      }
      var text = node.classList.contains("chorus-timer") ? "running for " + duration((now - date) / 1000)
        : relative(date, now);
      if (node.textContent !== text) node.textContent = text;
    });
  }

  window.chorusTimes = {update: update, duration: duration, relative: relative};
  update();
  setInterval(update, 1000);
})();
